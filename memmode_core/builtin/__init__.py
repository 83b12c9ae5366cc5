"""Plugins shipped inside memmode-core; they register through the same hooks as installed ones."""
