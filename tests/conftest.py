import os
import sys

# tests import their slow references (tests/reference_impl.py) by module name
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
