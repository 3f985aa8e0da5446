import os
import sys

# the tests import the package from the checkout (built in place by `pip install -e .`), and the
# shared helpers (hf_reference, fp8_weights, ...) from tests/helpers/
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))
