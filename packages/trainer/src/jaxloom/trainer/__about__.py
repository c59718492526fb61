__version__ = "0.34.2"
