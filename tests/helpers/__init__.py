"""Shared test helpers: fakes, real servers started for tests, test models and data, the tier
collection rule. Test modules import from here (or get fixtures from a folder's ``conftest.py``);
no test module imports another."""
