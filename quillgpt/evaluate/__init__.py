"""(package docstring: see DESIGN.md)"""
