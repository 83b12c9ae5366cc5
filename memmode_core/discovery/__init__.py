"""Layer 2, discovery: finding plugins (entry points, built-ins by module name) and parsing mode strings.

Above the contracts and the mechanics (registrations are checked against their base classes, ``Quantizer``
included), below the planner and the built-in plugins.
"""
