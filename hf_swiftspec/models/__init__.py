"""What a model can do, from its config and classes (architectures.py), and every contact with transformers'
internals that changes between releases (compat.py)."""
