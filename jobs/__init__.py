"""One entry point per job kind; each is a thin ``main(argv)`` that a node runs."""
