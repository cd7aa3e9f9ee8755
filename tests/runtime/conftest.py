import os
import sys

# test helpers (_fixtures.py) import by plain name under --import-mode=importlib
sys.path.insert(0, os.path.dirname(__file__))
