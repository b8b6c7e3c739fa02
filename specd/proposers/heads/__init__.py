"""Draft heads that read the target's hidden states (EAGLE, EAGLE-3, Medusa, MLP speculator):
torch modules plus loaders for the checkpoint layouts that are published for them. The
proposer that runs them per sequence is specd/proposers/hidden_state.py."""
