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


CORPORA = ("base", "broad", "self")


def build_corpus(size: int = 4000, seed: int = 0, exclude: set[str] | None = None, corpus: str = "base") -> list[str]:
    """A shuffled, de-duplicated list of `size` prompts (fewer if the templates run out).

    ``corpus``: "base" (topic templates, code tasks, stdlib docstrings, arithmetic) or "broad"
    (advice, short writing, explanations, code in nine languages, SQL, shell, word problems).
    """
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; choose one of {', '.join(CORPORA)}")
    if corpus == "self":
        raise ValueError("the 'self' corpus is written by the target itself: see bastion.train.make_requests")
    rng = random.Random(seed)
    topics = [t.strip() for t in TOPICS if t.strip()]
    tasks = [c.strip() for c in CODE_TASKS if c.strip()]
    pools = {
        "chat": [tpl.format(t=t, u=rng.choice(topics)) for tpl in CHAT_TEMPLATES for t in topics],
        "code": [tpl.format(c=c) for tpl in CODE_TEMPLATES for c in tasks] + _stdlib_prompts(),
        "math": [tpl.format(a=rng.randint(2, 99), b=rng.randint(2, 99), c=rng.randint(2, 999))
                 for tpl in MATH_TEMPLATES for _ in range(60)],
    }
    if corpus == "broad":
        pools = _broad_pools(rng)
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


# --------------------------------------------------------------------------- the "broad" corpus
# Everyday requests of the kinds people send a chat assistant: advice, short writing, explanations,
# code in several languages, SQL, word problems with varied wording. Written for this project.
GOALS = """get better sleep, save money on groceries, learn to cook simple meals, stay focused while studying, make friends
after moving to a new city, prepare for a first half marathon, ask for a raise, keep houseplants alive, spend less time
on my phone, write a strong cover letter, organize a small closet, grow herbs on a balcony, house-train a puppy, speak up
in meetings, work with a difficult coworker, plan a birthday party on a budget, learn to play the guitar, start
journaling, get up earlier in the morning, pack light for a week-long trip, study for a driving test, reduce food waste
at home, make my resume stand out, keep a conversation going on a first date, start running as a beginner, motivate
myself to exercise in winter, improve my handwriting, remember people's names, learn to touch type, cook for a big
family dinner, keep my bike in good shape, choose a laptop for college, set up a monthly budget, prepare for a job
fair, get over a fear of flying, keep a long-distance friendship alive, stop procrastinating on homework, teach my kid
to ride a bike, decorate a small apartment cheaply, make my morning routine faster, write better emails at work, start
a book club, learn basic first aid, improve my posture at a desk, prepare for a camping trip, take better photos with
my phone, get along with a new roommate, volunteer in my community, keep my car clean, learn a new language on my
commute, pick a gift for a coworker, recover after a long flight, keep track of my expenses""".split(",")

ADVICE_TEMPLATES = [
    "How can I {g}?", "What are some tips to {g}?", "I want to {g}. Where should I start?",
    "What mistakes should I avoid when I try to {g}?", "Give me a simple step-by-step plan to {g}.",
    "My friend wants to {g}. What would you suggest?", "Is it hard to {g}? Give me honest advice.",
    "What are three small things I can do this week to {g}?",
]

WRITING_KINDS = ["a short email", "a text message", "a toast", "a short poem", "a product description", "a two-minute speech",
                 "an apology note", "an invitation", "a short review", "a social media post", "a letter", "a limerick",
                 "a slogan", "an announcement", "a short bio", "a motivational message", "a short story opening",
                 "a farewell card message", "a dialogue between two friends"]
WRITING_PURPOSES = [
    "for a friend who just moved abroad", "for a charity bake sale", "announcing a new coffee shop in town",
    "for a colleague who is retiring", "inviting neighbors to a street party", "about a lost cat", "for a school science fair",
    "for a family reunion", "about a rainy Monday morning", "for a small bookshop's anniversary", "about learning to swim",
    "for a team that just finished a hard project", "about a cozy winter evening", "for a local farmers market",
    "for a new yoga studio", "about the first day of spring", "for a friend's graduation", "about a trip to the mountains",
    "to a landlord about a broken heater", "for a community garden", "to thank a nurse", "about a favorite childhood toy",
]

WHY_TOPICS = """cats purr, we yawn, the sky look blue, onions make people cry, bread rise, ice float on water, birds
migrate, our ears pop on airplanes, we get goosebumps, stars twinkle, the sea taste salty, we dream, metal feel cold,
soap remove grease, bees make honey, the moon change shape, we get hiccups, apples turn brown after cutting, dogs wag
their tails, balloons stick to hair after rubbing, cold weather make my nose run, mirrors flip left and right, popcorn
pop, plants need sunlight, clouds float, thunder come after lightning, cheese have holes, people have different blood
types, the ocean have tides, coffee keep us awake""".split(",")

EXPLAIN_TEMPLATES = ["Why do {w}?", "Can you explain why {w}?", "Give a short scientific explanation of why {w}.",
                     "My child asked me why {w}. How should I answer?"]

JOBS = ["nurse", "firefighter", "software developer", "farmer", "pilot", "chef", "librarian", "electrician", "teacher",
        "veterinarian", "architect", "bus driver", "journalist", "park ranger", "baker", "dentist", "plumber", "astronaut"]
JOB_TEMPLATES = ["Describe a typical day of a {j}.", "What skills does a {j} need?", "How does someone become a {j}?",
                 "What is the hardest part of working as a {j}?"]

LANGS = ["Python", "JavaScript", "TypeScript", "Java", "C++", "Go", "Rust", "C#", "Ruby"]
FUNC_TASKS = """returns the sum of all even numbers in a list, counts how many times each word appears in a sentence,
returns the longest common prefix of a list of strings, checks whether a year is a leap year, returns the k largest
numbers of a list, removes all whitespace from a string, converts a number of seconds into hours, minutes and seconds,
checks whether a string contains only digits, returns the intersection of two arrays, computes the running total of a
list, capitalizes the first letter of each sentence, returns the product of all numbers in a list, finds the first
non-repeating character in a string, groups a list of words by their first letter, returns the mode of a list, merges
two dictionaries, checks whether a number is a perfect square, splits a list into even and odd numbers, converts a
string to title case, returns the distance between two points, counts the uppercase letters in a string, returns the
last n elements of a list, checks whether all elements of a list are unique, converts kilometers to miles, returns a
list without its negative numbers, pads a number with leading zeros, finds the index of the minimum value, computes
compound interest, validates a password's strength, shuffles a list in place""".split(",")
FUNC_TEMPLATES = ["Write a {lang} function that {t}.", "In {lang}, how do I write a function that {t}?",
                  "Write a {lang} function that {t}, and add a short test."]

CLASS_THINGS = """to-do list with add, complete and list methods, shopping cart with add_item, remove_item and total methods,
library book with check_out and return_book methods, temperature sensor that keeps the last ten readings, parking lot
with park and leave methods, deck of cards with shuffle and deal methods, stopwatch with start, stop and reset methods,
simple inventory with add_stock and remove_stock methods, student with a list of grades and an average method,
rectangle with area and perimeter methods, playlist with add_song, remove_song and shuffle methods, counter that can be
incremented, decremented and reset, queue with a maximum size, timer that calls a function after a delay, contact book
with add, find and delete methods""".split(",")
CLASS_TEMPLATES = ["Write a Python class for a {c}.", "Implement a {lang} class for a {c}."]

SQL_TASKS = """counts the orders placed in each month, finds employees who earn more than the average salary, lists the
products that were never ordered, returns the average salary per department, finds duplicate email addresses in a users
table, returns the three most recent orders of each customer, counts the students enrolled in each course, lists
customers who placed no order last year, computes the total revenue per product category, finds the second highest
salary, lists authors with more than five books, returns the number of new users per day""".split(",")
SHELL_TASKS = """finds the ten largest files in a directory, renames all .txt files to .md, counts the lines of every log
file, deletes files older than seven days, prints the most common words in a text file, lists the running processes
that use the most memory, compresses a folder into a tar.gz archive, replaces a word in every file of a folder""".split(",")

NAMES = ["Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kira", "Liam", "Mina",
         "Noah", "Olga", "Priya", "Quinn", "Rosa", "Tariq", "Uma", "Victor", "Wen", "Yusuf", "Zoe"]
ITEMS = ["cupcakes", "stickers", "marbles", "books", "apples", "pencils", "tickets", "postcards", "cookies", "seashells"]
WORD_PROBLEMS = [
    "{n} had {a} {i} and bought {b} more. Then {n} gave away {c}. How many {i} does {n} have now?",
    "A school trip has {a} students and each bus holds {b} students. How many buses are needed?",
    "{n} reads {a} pages a day. How many days will it take to finish a book of {b0} pages?",
    "A jacket costs ${b0} and is discounted by {p}%. What is the new price?",
    "A car travels at {a} km per hour for {h} hours. How far does it go?",
    "{n} is {a} years old and her brother is {b} years younger. How old will he be in {c} years?",
    "The ratio of boys to girls in a class is {r1}:{r2}. If there are {a0} students, how many are girls?",
    "A tank holds {b0} liters of water and {a} liters leak out every hour. How long until it is empty?",
    "What is {p}% of {b0}? Explain how you got the answer.",
    "A rectangle has a perimeter of {b0} cm and a width of {a} cm. What is its length?",
    "{n} earns ${a} per hour and works {b} hours a week. How much does {n} earn in {c} weeks?",
    "A recipe uses {r1} cups of sugar for every {r2} cups of flour. How much sugar is needed for {a} cups of flour?",
    "Solve for y: {a}y - {b} = {c0}. Show each step.", "What is the next number in the sequence {s}? Explain the rule.",
    "Convert {c0} minutes into hours and minutes.", "If {a} workers build a wall in {h} days, how long would {b} workers take?",
    "A bag has {a} red and {b} blue marbles. What is the probability of picking a red one?",
    "Find the average of {a}, {b}, {c} and {h}.", "What is {a} divided by {h}, as a decimal and as a fraction?",
    "{n} saves ${a} every week. How many weeks until {n} has saved ${b0}?",
]


def _sequence(rng: random.Random) -> str:
    kind = rng.randrange(3)
    start, step = rng.randint(1, 9), rng.randint(2, 7)
    if kind == 0:
        xs = [start + step * i for i in range(5)]
    elif kind == 1:
        xs = [start * step ** i for i in range(5)]
    else:
        xs = [i * (i + step) for i in range(1, 6)]
    return ", ".join(map(str, xs)) + ", ..."


def _word_problem(rng: random.Random) -> str:
    tpl = rng.choice(WORD_PROBLEMS)
    return tpl.format(n=rng.choice(NAMES), i=rng.choice(ITEMS), a=rng.randint(3, 60), b=rng.randint(2, 30),
                      c=rng.randint(1, 20), h=rng.randint(2, 9), p=rng.choice([5, 10, 15, 20, 25, 30, 40, 50, 75]),
                      b0=rng.randint(5, 60) * 10, a0=rng.randint(4, 12) * 6, c0=rng.randint(20, 400),
                      r1=rng.randint(1, 5), r2=rng.randint(1, 5), s=_sequence(rng))


def _broad_pools(rng: random.Random) -> dict[str, list[str]]:
    goals = [g.strip() for g in GOALS if g.strip()]
    whys = [w.strip() for w in WHY_TOPICS if w.strip()]
    funcs = [t.strip() for t in FUNC_TASKS if t.strip()]
    things = [c.strip() for c in CLASS_THINGS if c.strip()]
    return {
        "advice": [tpl.format(g=g) for tpl in ADVICE_TEMPLATES for g in goals],
        "writing": [f"Write {k} {p}." for k in WRITING_KINDS for p in WRITING_PURPOSES],
        "explain": [tpl.format(w=w) for tpl in EXPLAIN_TEMPLATES for w in whys]
                   + [tpl.format(j=j) for tpl in JOB_TEMPLATES for j in JOBS],
        "code": [tpl.format(lang=lang, t=t) for tpl in FUNC_TEMPLATES for lang in LANGS for t in funcs]
                + [tpl.format(c=c, lang=rng.choice(LANGS)) for tpl in CLASS_TEMPLATES for c in things]
                + [f"Write a SQL query that {t.strip()}." for t in SQL_TASKS if t.strip()]
                + [f"Write a bash command that {t.strip()}." for t in SHELL_TASKS if t.strip()],
        "math": [_word_problem(rng) for _ in range(3000)],
    }


# --------------------------------------------------------------------------- the "self" corpus
# The target writes the requests itself (bastion.train.make_requests): a raw-text list of example
# requests, sampled onward, gives varied, realistic prompts in the target's own register — closer to
# what users send than any template. The examples below were written for this project; none is an
# evaluation prompt (a test checks).
SEED_REQUESTS = {
    "chat": [
        "How do I politely decline a wedding invitation from a coworker?",
        "Can you suggest a weekend itinerary for a first visit to Lisbon?",
        "Write a short poem about autumn leaves for my daughter's class.",
        "My sourdough starter smells like nail polish. Is it still safe to use?",
        "Explain how a credit score works in simple terms.",
        "What should I pack for a three-day hiking trip in the rain?",
        "Write a friendly reminder to my team that timesheets are due on Friday.",
        "What are some easy vegetarian dinners I can cook in twenty minutes?",
        "How can I help my teenager manage exam stress?",
        "Give me five ideas for a rainy afternoon with two young kids.",
        "Why does my laptop get so hot when I watch videos?",
        "Rewrite this sentence to sound more professional: we kinda messed up the order.",
        "What is a good way to start learning to draw as an adult?",
        "Summarize the main causes of the First World War in a paragraph.",
        "How do I tell my landlord that the kitchen faucet has been leaking for a week?",
    ],
    "code": [
        "Write a Python function that merges two dictionaries and sums the values of shared keys.",
        "What is the difference between a list and a tuple in Python?",
        "Write a JavaScript function that debounces another function.",
        "Write a bash one-liner that counts the lines in all .txt files in a folder.",
        "How do I read a JSON file in Python and print one of its fields?",
        "Write a SQL query that lists each department with its average salary.",
        "Fix this Python code: for i in range(10) print(i)",
        "Write a Python class for a to-do list with add, remove and list methods.",
        "Explain what a recursive function is and give a short example in Python.",
        "Write a Python function that returns the most common letter in a string.",
        "How can I remove duplicate rows from a pandas DataFrame?",
        "Write a Java method that reverses the words in a sentence.",
        "Write a Python script that renames every .jpeg file in a folder to .jpg.",
        "What does the `yield` keyword do in Python?",
        "Write a C function that returns the length of a string without using strlen.",
    ],
    "math": [
        "A farmer has 36 chickens and sells a quarter of them. How many chickens are left?",
        "If a shirt costs $25 and is on sale for 20% off, what is the sale price?",
        "How many minutes are there in three and a half hours?",
        "Solve 5x + 3 = 28 and show each step.",
        "A car travels 180 km on 12 liters of fuel. How far can it go on 20 liters?",
        "What is the area of a circle with a radius of 4 cm?",
        "Lena reads 15 pages a day. How many days does she need for a 240-page book?",
        "What is the least common multiple of 6 and 8?",
        "A class has 14 boys and 16 girls. What fraction of the class are girls?",
        "Convert 3/8 to a decimal and to a percentage.",
        "Three friends share a $54 bill equally and leave a $9 tip. How much does each pay?",
        "What is the next number in the sequence 2, 6, 12, 20, 30?",
        "A tank holds 500 liters and fills at 25 liters per minute. How long does it take to fill?",
        "Is 91 a prime number? Explain why or why not.",
        "What is the perimeter of a square whose area is 49 square meters?",
    ],
}
REQUEST_CATEGORIES = tuple(SEED_REQUESTS)
_SEEDS = frozenset(q for qs in SEED_REQUESTS.values() for q in qs)


def request_prompt(rng: random.Random, category: str, shots: int = 5) -> str:
    """Raw text (no chat template) that a language model continues with one more request of `category`:
    a numbered list of `shots` examples drawn from SEED_REQUESTS, ending in the next number."""
    examples = rng.sample(SEED_REQUESTS[category], shots)
    head = "Here are some requests that users sent to an AI assistant:\n"
    return head + "".join(f"{i + 1}. {q}\n" for i, q in enumerate(examples)) + f"{shots + 1}."


def parse_requests(text: str, shots: int = 5, min_chars: int = 15, max_chars: int = 300) -> list[str]:
    """The requests in a continuation of `request_prompt`: its first line, then each following line
    numbered shots+2, shots+3, … (the model often goes on listing). A line counts only if it is
    complete (ends in ? . ! or `:`), of a sane length, and not one of the seed examples."""
    out = []
    for i, line in enumerate(text.split("\n")):
        if i > 0:
            num = f"{shots + 1 + i}."
            if not line.startswith(num):
                break
            line = line[len(num):]
        line = " ".join(line.split())
        if min_chars <= len(line) <= max_chars and line[-1] in "?.!:" and line not in _SEEDS:
            out.append(line)
    return out
