"""Reading and writing checkpoints safely: output-folder rules, atomic saves, and which code
a folder may ask us to run."""
