"""Everyday chat questions for the drafter's training answers, beyond the stdlib-built prompts.

The held-out chat workload (training/specd_train/workloads.py) is everyday questions answered in prose; the
stdlib-built prompts (prompts.py) hold only 600 such questions from 50 topics. These lists
give thousands more, from subjects and tasks chosen apart from the held-out questions (none
of those subjects is here, and `everyday_questions` refuses an exact held-out question).
Deterministic: fixed lists, a seeded shuffle.
"""
from __future__ import annotations

import random

SUBJECTS = (
    "the solar system", "the ocean floor", "glaciers", "deserts", "rain forests", "the Amazon river",
    "the Sahara", "mountains", "caves", "lightning", "snowflakes", "fog", "wind turbines", "batteries",
    "magnets", "electricity", "sound waves", "light", "mirrors", "lenses", "telescopes", "microscopes",
    "atoms", "molecules", "chemical reactions", "acids and bases", "rust", "fire", "steam engines",
    "bridges", "skyscrapers", "tunnels", "canals", "trains", "ships", "submarines", "rockets",
    "satellites", "the International Space Station", "Mars", "Jupiter", "comets", "meteor showers",
    "eclipses", "stars", "galaxies", "the Big Bang", "dark matter", "quantum computers", "transistors",
    "smartphones", "email", "passwords", "encryption", "databases", "spreadsheets", "operating systems",
    "open source software", "video games", "virtual reality", "robots", "self-driving cars", "drones",
    "3D printing", "cloud computing", "search engines", "social media", "podcasts", "libraries",
    "museums", "newspapers", "the alphabet", "poetry", "novels", "theater", "opera", "jazz",
    "classical music", "the piano", "the violin", "drums", "painting", "sculpture", "photography",
    "architecture", "ancient Egypt", "ancient Greece", "the Vikings", "the Silk Road", "the Aztecs",
    "the Middle Ages", "castles", "knights", "pirates", "explorers", "maps", "compasses", "calendars",
    "clocks", "money", "banks", "taxes", "credit cards", "savings accounts", "insurance", "mortgages",
    "small businesses", "marketing", "job interviews", "teamwork", "leadership", "negotiation",
    "friendship", "kindness", "gratitude", "habits", "motivation", "creativity", "memory", "emotions",
    "dreams", "the brain", "the lungs", "bones", "muscles", "the skin", "teeth", "eyes", "ears",
    "vitamins", "protein", "sugar", "fiber", "allergies", "colds", "fever", "first aid", "yoga",
    "running", "swimming", "cycling", "hiking", "chess", "football", "basketball", "tennis",
    "the Tour de France", "marathons", "dogs", "horses", "elephants", "whales", "dolphins", "sharks",
    "octopuses", "penguins", "owls", "eagles", "butterflies", "ants", "spiders", "frogs", "snakes",
    "turtles", "wolves", "bears", "lions", "trees", "flowers", "mushrooms", "cactuses", "bamboo",
    "wheat", "chocolate", "cheese", "pizza", "pasta", "soup", "spices", "olive oil", "fermentation",
    "composting", "houseplants", "birds in winter", "migration", "hibernation", "rivers", "lakes",
    "islands", "maple syrup", "paper", "glass", "plastic", "cotton", "wool", "concrete", "steel",
)
TASKS = (
    "bake bread at home", "change a flat tire", "write a cover letter", "plan a birthday party",
    "save money on groceries", "learn to swim", "train a puppy", "organize my closet", "start a vegetable garden",
    "make pancakes", "fix a leaky faucet", "prepare for a job interview", "study for an exam",
    "write a thank-you note", "paint a room", "keep houseplants alive", "make a smoothie", "brew coffee",
    "start running", "learn to code", "back up my computer", "choose a laptop", "clean a cast iron pan",
    "pack for a long flight", "travel on a budget", "make friends in a new city", "give a toast at a wedding",
    "write a short story", "take better photos with my phone", "stay focused while working from home",
    "make a budget spreadsheet", "negotiate a salary", "apologize to a friend", "teach a child to read",
    "care for a cat", "set up a fish tank", "build a bookshelf", "sharpen a kitchen knife",
    "remove a stain from a shirt", "make homemade pizza", "cook pasta", "roast vegetables", "make soup",
    "learn a card trick", "draw a portrait", "memorize a speech", "run a meeting", "write an email to my boss",
    "plan a road trip", "read more books", "wake up earlier", "drink less soda", "reduce food waste",
    "save energy at home", "recycle electronics", "choose running shoes", "learn chess", "knit a scarf",
    "make a paper airplane", "write a poem", "keep a journal", "start a podcast", "make a website",
    "learn Spanish", "prepare for a marathon", "cook for a large group", "host a dinner party",
    "grow tomatoes", "clean my keyboard", "speed up a slow computer", "create a strong password",
)
SUBJECT_TEMPLATES = (
    "Tell me about {s}.", "What should everyone know about {s}?", "Explain {s} in simple terms.",
    "What is the most surprising thing about {s}?", "Write two short paragraphs about {s}.",
    "How would you describe {s} to someone who has never heard of it?", "What is the history of {s}?",
    "What are five facts about {s}?", "Why do people find {s} interesting?", "How has {s} changed over time?",
    "What questions do scientists still have about {s}?", "Can you give me a simple explanation of {s}?",
    "Write a short poem about {s}.", "What would a beginner's guide to {s} include?",
    "Describe {s} in a few sentences.", "What are the main ideas behind {s}?",
)
TASK_TEMPLATES = (
    "How do I {t}?", "What is the best way to {t}?", "Give me step-by-step instructions to {t}.",
    "What mistakes should I avoid when I {t}?", "I want to {t}. Where should I start?",
    "Can you give me some tips to {t}?", "What do I need to {t}?", "How long does it take to {t}?",
)


def everyday_questions(limit: int, seed: int = 1) -> list[list[dict]]:
    """`limit` single-turn chat message lists, in a fixed shuffled order."""
    from specd_train.workloads import CHAT_QUESTIONS

    pool = [t.format(s=s) for s in SUBJECTS for t in SUBJECT_TEMPLATES]
    pool += [t.format(t=task) for task in TASKS for t in TASK_TEMPLATES]
    held_out = set(CHAT_QUESTIONS)
    pool = [q for q in pool if q not in held_out]
    random.Random(seed).shuffle(pool)
    return [[{"role": "user", "content": q}] for q in pool[:limit]]
