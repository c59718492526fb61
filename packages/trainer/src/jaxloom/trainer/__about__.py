__version__ = "0.41.0"
