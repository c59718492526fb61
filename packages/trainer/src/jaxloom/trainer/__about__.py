__version__ = "0.36.0"
