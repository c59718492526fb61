__version__ = "0.29.0"
