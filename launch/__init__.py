"""The launcher (``submit.py``) and the backends that submit; stage code never imports this."""
