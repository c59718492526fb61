__version__ = "0.39.1"
