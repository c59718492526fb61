__version__ = "0.38.0"
