__version__ = "0.31.0"
