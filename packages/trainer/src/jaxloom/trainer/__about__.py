__version__ = "0.35.0"
