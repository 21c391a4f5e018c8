"""Every drafter, behind one interface (drafting.py): a draft model's token tree, EAGLE-3 heads and MTP layers
(heads.py, eagle3.py, mtp.py), and suffix proposals (suffix.py)."""
