from quillgpt.cli import main

main()
