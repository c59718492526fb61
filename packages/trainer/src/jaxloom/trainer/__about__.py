__version__ = "0.37.0"
