"""The ``yuebing`` command. Each ``cmd_*.py`` module here contributes commands; see `main`."""
