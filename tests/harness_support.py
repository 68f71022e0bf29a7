"""Small local lm-eval tasks (YAML + jsonl written into a folder: nothing is downloaded) and
reading each request's responses out of lm-eval's results. Not collected: no test_ prefix."""

import json

from hf_support import CORPUS

TASKS = ["tiny_mc", "tiny_gen", "tiny_roll"]
MC = [
    ("ROMEO: But, soft! what light through yonder", [" window", " door", " wall", " sun"], 0),
    ("JULIET: O Romeo, Romeo! wherefore art thou", [" Romeo?", " here", " gone", " there"], 0),
    ("The quick brown fox jumps over the", [" lazy dog.", " cat", " moon", " fence"], 0),
    ("KING HENRY: Once more unto the breach, dear", [" friends", " foes", " sir", " lords"], 1),
    ("Ça va? Très bien,", [" merci.", " non", " oui", " déjà vu"], 2),
    ("It is the east, and Juliet is the", [" sun.", " moon.", " east.", " night."], 0),
]
GEN = [("ROMEO: But, soft!", " what"), ("JULIET: O Romeo,", " Romeo!"), ("The quick brown", " fox"), ("Or close the wall", " up")]


def write_tasks(directory):
    """Three lm-eval tasks over local jsonl files (dataset_path: json): nothing is downloaded."""
    directory.mkdir()
    cache = directory / "hf_cache"
    (directory / "mc.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "label": a}) + "\n" for q, c, a in MC))
    (directory / "gen.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in GEN))
    (directory / "roll.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
    common = f"dataset_path: json\ntest_split: train\ndataset_kwargs:\n  cache_dir: {cache}\n  data_files:\n    train: "
    (directory / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\n{common}{directory / 'mc.jsonl'}\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_target: "{{label}}"\ndoc_to_choice: "{{choices}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (directory / "tiny_gen.yaml").write_text(
        f"task: tiny_gen\n{common}{directory / 'gen.jsonl'}\noutput_type: generate_until\n"
        'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n", "!"]\n  max_gen_toks: 10\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    (directory / "tiny_roll.yaml").write_text(
        f"task: tiny_roll\n{common}{directory / 'roll.jsonl'}\noutput_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"
    )
    return directory


def responses(results):
    """task → each request's response, in document order."""
    out = {}
    for task, samples in results["samples"].items():
        out[task] = [r for s in sorted(samples, key=lambda s: s["doc_id"]) for r in s["resps"]]
    return out
