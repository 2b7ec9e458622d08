"""Data sources: which files a data path names and their records (files.py), the tokenized cache
of a text corpus (cache.py), weighted mixtures of sources (mixture.py) and batches prepared ahead
on a thread (prefetch.py)."""
