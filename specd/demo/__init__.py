"""specd/demo"""
