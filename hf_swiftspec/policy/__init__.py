"""How much to speculate: the goodput policy (goodput.py) over measured step costs (costs.py), and the engine
the costs choose (choice.py)."""
