"""Every JSON route, one module per URL prefix; deps.py holds the FastAPI dependencies they use."""
