"""Output: one renderer per format behind one interface, and progress."""
