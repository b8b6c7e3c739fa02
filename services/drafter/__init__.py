"""Drafter service and proposers (specd.drafter). Built in a later issue."""
