"""End-to-end recipes that join training and evaluation: the quickstart (with its budget planner),
depth acceptance, the sweep report. Nothing but tests and scripts imports them."""
