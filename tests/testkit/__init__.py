"""Helpers shared by the test folders (pytest puts tests/ on the path: pyproject's `pythonpath`):
small models and adapter files, recorded reference data, fusion-site and node fixtures."""
