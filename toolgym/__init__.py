"""The top of the stack: the ``toolgym`` console script and what it launches.

``toolgym.cli`` holds the subcommands (the servers they start are ``trainer.launch``'s, the ones a
Python run launches for itself), and ``toolgym.kit`` builds the tiny offline models the tests and
the demo train. Nothing below (``sdk``, ``environments``, ``envserver``, ``trainer``) imports this
package.
"""
