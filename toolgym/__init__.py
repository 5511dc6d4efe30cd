"""The top of the stack: the ``toolgym`` console script and what it launches.

``toolgym.cli`` holds the subcommands, ``toolgym.launch`` starts and stops vLLM servers, and
``toolgym.kit`` builds the tiny offline models the tests and the demo train. Nothing below
(``sdk``, ``environments``, ``envserver``, ``trainer``) imports this package.
"""
