"""yuebing: a Python implementation of Mooncake, KVCache-centric disaggregated LLM serving.

See docs/structure.md for the package map and a request's path through the code.
"""

__version__ = "0.1.0"
