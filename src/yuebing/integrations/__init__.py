"""Other engines under yuebing (`vllm`). Never imported by the default install's code paths."""
