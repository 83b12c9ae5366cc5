"""Layer 3, the planner: the cost of every mode for a pipeline, predicted without running it.

Above discovery (it enumerates the installed plugins), below the built-in plugins (``auto`` asks it).
"""
