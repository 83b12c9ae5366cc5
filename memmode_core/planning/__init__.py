"""Layer 3, planning: one plan per request, computed once, and what it would cost.

``prepared`` resolves a request and prepares a target (layout, claimed groups, quantization plans,
sizes); ``prepare`` is the public entry, and resolves a resolver's choice (``auto``); ``layout`` is a
placement's layout as core adjusts it; ``planner`` prices prepared plans; ``costs`` says what a storage
costs, measuring what is not declared. Above discovery (it enumerates the installed plugins), below the
built-in plugins (``auto`` uses the planner's defaults and choice).
"""
