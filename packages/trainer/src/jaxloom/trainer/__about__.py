__version__ = "0.40.0"
