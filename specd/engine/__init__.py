"""specd/engine"""
