"""An offline prompt corpus for self-distillation: chat, code and math prompts built from templates,
word lists and the docstrings of Python's own standard library (available on every machine).

Deterministic for a given seed. The evaluation suite (assets/eval_prompts.json) is written by hand
and checked to be disjoint from this corpus (``build_corpus(exclude=...)`` drops exact matches).
"""

from __future__ import annotations

import importlib
import inspect
import random

TOPICS = """photosynthesis, black holes, the French Revolution, climate change, volcanoes, the immune system,
machine learning, the stock market, inflation, the Roman Empire, jazz music, the water cycle, plate tectonics,
vaccines, the internet, blockchain, renewable energy, the Moon landing, DNA, evolution, gravity, electricity,
the human brain, sleep, meditation, coffee, chess, the Olympic Games, honeybees, coral reefs, rainforests,
deserts, the Great Wall of China, the printing press, the Industrial Revolution, democracy, taxes, recycling,
nuclear power, solar panels, electric cars, airplanes, submarines, bicycles, trains, the Renaissance,
Shakespeare, classical music, painting, photography, cinema, video games, social media, smartphones,
cybersecurity, passwords, cloud computing, databases, operating systems, compilers, quantum computing,
prime numbers, probability, statistics, algebra, geometry, calculus, the Pythagorean theorem, fractions,
budgeting, saving money, job interviews, public speaking, time management, learning a language, cooking pasta,
baking bread, healthy eating, running, yoga, gardening, houseplants, dogs, cats, birds, whales, dinosaurs,
the solar system, Mars, stars, comets, weather forecasts, hurricanes, earthquakes, tsunamis, glaciers,
oceans, rivers, mountains, maps, ancient Egypt, the pyramids, Greek mythology, the Vikings, the Silk Road,
coffee shops, libraries, museums, writing a resume, email etiquette, friendship, teamwork, leadership,
negotiation, critical thinking, habits, motivation, stress, first aid, hand washing, antibiotics, the heart,
the lungs, bones, muscles, vitamins, water, salt, sugar, chocolate, tea, volunteering, elections, the moon's
phases, rainbows, lightning, magnets, sound, light, color, temperature, batteries, robots, 3D printing""".split(",")

CHAT_TEMPLATES = [
    "What is {t}?", "Explain {t} in simple terms.", "Give me three interesting facts about {t}.",
    "Why is {t} important?", "How would you explain {t} to a ten-year-old?", "Write a short paragraph about {t}.",
    "What are the main benefits and drawbacks of {t}?", "Summarize the history of {t} in a few sentences.",
    "What are common misconceptions about {t}?", "Write a haiku about {t}.", "List five questions a student might ask about {t}.",
    "How does {t} affect everyday life?", "Compare {t} and {u}.", "What is the connection between {t} and {u}?",
    "Write a short story that involves {t}.", "Give me a study plan to learn about {t} in one week.",
    "What should a beginner know about {t}?", "Describe {t} in exactly three sentences.",
]

CODE_TASKS = """reverse a string, check whether a number is prime, compute the factorial of n, merge two sorted lists,
find the largest element in a list, count the vowels in a string, remove duplicates from a list while keeping order,
compute the n-th Fibonacci number, check whether a string is a palindrome, flatten a nested list, convert Celsius to
Fahrenheit, sort a list of dictionaries by a key, read a CSV file and print each row, count word frequencies in a text,
compute the greatest common divisor of two numbers, implement binary search, transpose a matrix, validate an email
address with a regular expression, find the second largest number in a list, rotate a list by k positions, compute the
average of a list of numbers, generate all permutations of a string, check whether two strings are anagrams, implement a
stack class, implement a queue using two stacks, parse a date string, compute the sum of digits of an integer, convert a
decimal number to binary, find common elements of two lists, chunk a list into pieces of size n, capitalize every word in
a sentence, compute the median of a list, implement bubble sort, implement quicksort, count lines in a file, download
nothing but simulate a retry loop with exponential backoff, memoize a function, compute the power set of a set, check
balanced parentheses, find the longest word in a sentence""".split(",")

CODE_TEMPLATES = [
    "Write a Python function to {c}.", "How do I {c} in Python?", "Write a JavaScript function to {c}.",
    "Show me a short example that shows how to {c}, with comments.", "Write a C function to {c}.",
    "Explain step by step how to {c} in Python, then give the code.",
]

MATH_TEMPLATES = [
    "A shop sells pencils for {a} cents each. How much do {b} pencils cost in dollars?",
    "What is {a} times {b}?", "What is {a} plus {b} minus {c}?", "Solve for x: {a}x + {b} = {c}.",
    "A train travels {a} km in {b} hours. What is its average speed?",
    "If a rectangle is {a} cm long and {b} cm wide, what are its area and perimeter?",
    "What is {a} percent of {b}?", "Simplify the fraction {a}/{b}.",
    "Tom has {a} apples and gives {b} to his friend. Then he buys {c} more. How many apples does he have?",
    "A recipe needs {a} grams of flour for {b} cookies. How much flour is needed for {c} cookies?",
    "What is the sum of the integers from 1 to {a}?", "Is {a} a prime number? Explain.",
    "Convert {a} minutes into hours and minutes.", "What is the average of {a}, {b} and {c}?",
    "A car uses {a} liters of fuel per 100 km. How much fuel does it need for {b} km?",
    "Find the least common multiple of {a} and {b}.", "What is {a} squared minus {b} squared?",
]

STDLIB_MODULES = ["string", "textwrap", "json", "csv", "itertools", "functools", "collections", "statistics", "math",
                  "random", "datetime", "calendar", "heapq", "bisect", "os.path", "shutil", "pathlib", "re", "difflib",
                  "fractions", "decimal", "operator", "copy", "pprint", "base64", "hashlib", "zlib", "gzip", "urllib.parse",
                  "html", "uuid", "secrets", "glob", "fnmatch", "tempfile", "configparser", "argparse", "logging"]


def _stdlib_prompts() -> list[str]:
    """'Write a Python function that …' from the first docstring line of public stdlib callables."""
    out = []
    for name in STDLIB_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        for attr in sorted(dir(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr, None)
            doc = inspect.getdoc(obj) if callable(obj) else None
            if not doc:
                continue
            line = doc.strip().splitlines()[0].strip().rstrip(".")
            if not 20 <= len(line) <= 120:
                continue
            if len(out) % 2:
                out.append(f"Write a Python function that does the following: {line[0].lower() + line[1:]}.")
            else:
                out.append(f"Explain what `{name}.{attr}` does in Python and show an example. Its summary: {line}.")
    return out


def build_corpus(size: int = 4000, seed: int = 0, exclude: set[str] | None = None) -> list[str]:
    """A shuffled, de-duplicated list of `size` prompts (fewer if the templates run out)."""
    rng = random.Random(seed)
    topics = [t.strip() for t in TOPICS if t.strip()]
    tasks = [c.strip() for c in CODE_TASKS if c.strip()]
    pools = {
        "chat": [tpl.format(t=t, u=rng.choice(topics)) for tpl in CHAT_TEMPLATES for t in topics],
        "code": [tpl.format(c=c) for tpl in CODE_TEMPLATES for c in tasks] + _stdlib_prompts(),
        "math": [tpl.format(a=rng.randint(2, 99), b=rng.randint(2, 99), c=rng.randint(2, 999))
                 for tpl in MATH_TEMPLATES for _ in range(60)],
    }
    exclude = exclude or set()
    for pool in pools.values():
        rng.shuffle(pool)
    seen: set[str] = set()
    prompts: list[str] = []
    # round-robin over the categories so any prefix of the corpus is balanced
    iters = [iter(p) for p in pools.values()]
    while len(prompts) < size and iters:
        for it in list(iters):
            p = next(it, None)
            if p is None:
                iters.remove(it)
            elif p not in seen and p not in exclude:
                seen.add(p)
                prompts.append(p)
    return prompts[:size]
