"""Strategies, contexts and distributed input (see :mod:`gpustrat`)."""
