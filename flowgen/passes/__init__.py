"""IR -> IR passes. The ordered list lives in `pipeline.py`."""
