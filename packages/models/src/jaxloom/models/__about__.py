__version__ = "0.22.1"
