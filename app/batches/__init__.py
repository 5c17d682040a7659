"""The Files and Batch APIs: files on disk with their rows in the database, batches run line by line in
the engine's idle seats (runner.py)."""
