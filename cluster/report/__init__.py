"""`raysweep report`: one self-contained HTML page on one or more sweep outputs (page.py), read-only."""
