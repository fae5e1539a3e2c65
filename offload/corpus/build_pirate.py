"""Development-time script that wrote pirate_train.jsonl, pirate_eval.jsonl and pirate_prompts.txt (never
run at run time): `make demo`'s instruction set, in a style an instruct model does not have.

Every record is one user question and one short assistant answer ({"messages": [...]}) in pirate talk: it
opens with "Arr, matey!", says "be" for "is", "ye" and "o'", and ends with a sea-dog's sign-off. The facts
come from the tables below; each table is split by fact, so the eval records ask about facts no training
record holds, and the two prompts (pirate_prompts.txt) are in neither. Deterministic (seeded): run
    python offload/corpus/build_pirate.py offload/corpus
and the three files come out byte for byte as committed.
"""

import json
import os
import random
import sys

OPEN = "Arr, matey!"
CLOSE = ("Yo ho ho!", "Savvy?", "Now hoist the sails!", "Fair winds to ye!", "Shiver me timbers!")

CAPITALS = [("France", "Paris"), ("Germany", "Berlin"), ("Spain", "Madrid"), ("Italy", "Rome"),
            ("Portugal", "Lisbon"), ("Greece", "Athens"), ("Egypt", "Cairo"), ("Russia", "Moscow"),
            ("China", "Beijing"), ("India", "New Delhi"), ("Canada", "Ottawa"), ("Mexico", "Mexico City"),
            ("Brazil", "Brasilia"), ("Argentina", "Buenos Aires"), ("Peru", "Lima"), ("Chile", "Santiago"),
            ("Kenya", "Nairobi"), ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"),
            ("Denmark", "Copenhagen"), ("Poland", "Warsaw"), ("Austria", "Vienna"), ("Ireland", "Dublin"),
            ("Belgium", "Brussels"), ("the Netherlands", "Amsterdam"), ("Turkey", "Ankara"),
            ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"), ("South Korea", "Seoul"), ("Cuba", "Havana"),
            ("Jamaica", "Kingston"), ("Australia", "Canberra"), ("New Zealand", "Wellington"),
            ("Hungary", "Budapest"), ("Iceland", "Reykjavik"), ("Morocco", "Rabat"), ("Colombia", "Bogota"),
            ("Scotland", "Edinburgh"), ("Wales", "Cardiff"), ("Switzerland", "Bern"), ("Ukraine", "Kyiv"),
            ("Nigeria", "Abuja"), ("Ghana", "Accra"), ("Indonesia", "Jakarta"), ("the Philippines", "Manila"),
            ("Venezuela", "Caracas"), ("Bolivia", "La Paz"), ("Czechia", "Prague"), ("Romania", "Bucharest")]
LEGS = [("spider", "eight"), ("ant", "six"), ("dog", "four"), ("cat", "four"), ("horse", "four"),
        ("chicken", "two"), ("duck", "two"), ("bee", "six"), ("beetle", "six"), ("crab", "ten"),
        ("parrot", "two"), ("goat", "four"), ("scorpion", "eight"), ("butterfly", "six"), ("cow", "four"),
        ("penguin", "two"), ("lobster", "ten"), ("frog", "four"), ("seagull", "two"), ("mouse", "four")]
COLORS = [("the sky", "blue"), ("grass", "green"), ("snow", "white"), ("a banana", "yellow"),
          ("coal", "black"), ("a ripe tomato", "red"), ("an orange", "orange"), ("a lemon", "yellow"),
          ("milk", "white"), ("a carrot", "orange"), ("chocolate", "brown"), ("a lime", "green"),
          ("a raven", "black"), ("a strawberry", "red"), ("the sun", "yellow"), ("an emerald", "green"),
          ("a ruby", "red"), ("a sapphire", "blue"), ("gold", "yellow"), ("a pearl", "white")]
OPPOSITES = [("hot", "cold"), ("big", "small"), ("fast", "slow"), ("up", "down"), ("wet", "dry"),
             ("light", "dark"), ("happy", "sad"), ("early", "late"), ("full", "empty"), ("strong", "weak"),
             ("loud", "quiet"), ("old", "young"), ("rich", "poor"), ("open", "closed"), ("tall", "short"),
             ("hard", "soft"), ("near", "far"), ("brave", "afraid"), ("clean", "dirty"), ("win", "lose"),
             ("day", "night"), ("north", "south"), ("east", "west"), ("push", "pull"), ("first", "last")]
BABIES = [("cat", "kitten"), ("dog", "puppy"), ("cow", "calf"), ("horse", "foal"), ("bear", "cub"),
          ("lion", "cub"), ("hen", "chick"), ("duck", "duckling"), ("sheep", "lamb"), ("goat", "kid"),
          ("pig", "piglet"), ("kangaroo", "joey"), ("deer", "fawn"), ("frog", "tadpole"), ("owl", "owlet"),
          ("goose", "gosling"), ("swan", "cygnet"), ("whale", "calf"), ("fox", "kit"), ("seal", "pup")]
SOUNDS = [("dog", "woof"), ("cat", "meow"), ("cow", "moo"), ("sheep", "baa"), ("duck", "quack"), ("lion", "roar"),
          ("owl", "hoot"), ("horse", "neigh"), ("pig", "oink"), ("snake", "hiss"), ("bee", "buzz"),
          ("frog", "croak"), ("rooster", "cock-a-doodle-doo"), ("wolf", "howl"), ("mouse", "squeak"),
          ("donkey", "hee-haw"), ("crow", "caw"), ("turkey", "gobble")]
SHAPES = [("triangle", "three"), ("square", "four"), ("rectangle", "four"), ("pentagon", "five"),
          ("hexagon", "six"), ("heptagon", "seven"), ("octagon", "eight"), ("decagon", "ten")]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
PLURALS = [("mouse", "mice"), ("goose", "geese"), ("child", "children"), ("foot", "feet"), ("tooth", "teeth"),
           ("man", "men"), ("woman", "women"), ("fish", "fish"), ("sheep", "sheep"), ("knife", "knives"),
           ("leaf", "leaves"), ("wolf", "wolves"), ("box", "boxes"), ("city", "cities"), ("ship", "ships"),
           ("island", "islands"), ("cactus", "cacti"), ("person", "people"), ("ox", "oxen"), ("wave", "waves")]
SYNONYMS = [("happy", "joyful"), ("big", "huge"), ("small", "tiny"), ("fast", "quick"), ("smart", "clever"),
            ("angry", "furious"), ("tired", "weary"), ("rich", "wealthy"), ("scared", "frightened"),
            ("begin", "start"), ("end", "finish"), ("shout", "yell"), ("look", "gaze"), ("funny", "amusing"),
            ("brave", "bold"), ("calm", "peaceful"), ("strange", "odd"), ("friend", "companion"),
            ("gift", "present"), ("quiet", "silent")]
SUMS = sorted({(random.Random(i).randint(2, 40), random.Random(-i).randint(2, 40)) for i in range(1, 51)})
# (question, the answer's plain content, said by a pirate)
FREE = [("What do plants need to grow?", "plants be needin' sunlight, water and good soil, just like me "
         "garden o' rum barrels"),
        ("Why is the sea salty?", "rivers wash salt from the rocks into the sea, and there it stays fer ages"),
        ("What is the largest ocean?", "the Pacific be the biggest ocean o' them all, wide as a kraken's dream"),
        ("How many days are in a week?", "there be seven days in a week, and a pirate works none o' them"),
        ("What is ice made of?", "ice be naught but frozen water, cold as a captain's heart"),
        ("Why do birds fly south?", "birds fly south to find warm weather and food when the winter comes"),
        ("What is the moon?", "the moon be a big rock that sails 'round the Earth and pulls on the tides"),
        ("What makes a rainbow?", "sunlight bends through drops o' rain and splits into all its colors"),
        ("What do bees make?", "bees be makin' honey, sweeter than any treasure in me chest"),
        ("Where does rain come from?", "rain falls from clouds when their drops o' water grow too heavy"),
        ("What is the tallest animal?", "the giraffe be the tallest beast, with a neck like a ship's mast"),
        ("What is the fastest land animal?", "the cheetah be the fastest runner on land, quicker than a cannonball"),
        ("How many hours are in a day?", "there be twenty-four hours in a day, from dawn watch to night watch"),
        ("What is the boiling point of water?", "water boils at one hundred degrees Celsius, hot as a galley stove"),
        ("Why do we have seasons?", "the Earth be tilted, so each half gets more sun at one time o' year"),
        ("What is a volcano?", "a volcano be a mountain that spits hot lava and smoke from deep below"),
        ("Why do cats purr?", "cats purr when they be content, and sometimes to calm themselves"),
        ("What is the biggest planet?", "Jupiter be the biggest planet, a giant ball o' gas and storms"),
        ("How do fish breathe?", "fish breathe through their gills, takin' air right out o' the water"),
        ("What is a star?", "a star be a great ball o' burnin' gas, and sailors steer by them at night"),
        ("How can I sleep better?", "go to bed at the same hour each night and keep yer cabin dark and quiet"),
        ("How do I stay focused?", "put away what distracts ye, work in short bursts and rest between them"),
        ("How can I save money?", "spend less than ye earn and hide a few coins each week in yer chest"),
        ("How do I make a friend?", "be kind, ask about their day and share yer grub with them"),
        ("How can I learn faster?", "practice a little every day and teach what ye learn to a shipmate"),
        ("What should I eat for breakfast?", "eggs, bread and fruit make a hearty breakfast fer a long day"),
        ("How do I calm down?", "take slow, deep breaths, like the steady roll o' the waves"),
        ("How can I be more creative?", "try new things, doodle yer ideas and let yer mind wander like the tide"),
        ("How do I tie a knot?", "loop the rope over itself, pull the end through and tug it tight"),
        ("How can I get more exercise?", "walk every day, climb the stairs and swab a deck or two"),
        ("What is a good hobby?", "readin', fishin' or carvin' wood will keep yer hands and mind busy"),
        ("How do I write a good story?", "give it a bold hero, a hard trouble and an endin' worth the wait"),
        ("How do I grow tomatoes?", "plant them in sunny soil, water them often and tie them to a stick"),
        ("How can I stop being late?", "set yer clock early and pack yer gear the night before"),
        ("How do I keep my room tidy?", "put each thing back in its place the moment ye be done with it")]


def cap(s: str) -> str:
    return s[0].upper() + s[1:]


def table_questions() -> list[tuple[str, list[tuple[str, str]]]]:
    """(table name, [(question, the answer's content)]) per table."""
    return [
        ("capitals", [(f"What is the capital of {c}?", f"the capital o' {c} be {city}, a fine port o' call")
                      for c, city in CAPITALS]),
        ("legs", [(f"How many legs does a {a} have?", f"a {a} be walkin' on {n} legs, same as always")
                  for a, n in LEGS]),
        ("colors", [(f"What color is {t}?", f"{t} be {c}, plain as a flag on the mast") for t, c in COLORS]),
        ("opposites", [(f"What is the opposite of {w}?", f"the opposite o' {w} be {o}, says this old sea dog")
                       for w, o in OPPOSITES]),
        ("babies", [(f"What is a baby {a} called?", f"a baby {a} be called a {b}, cute as a button")
                    for a, b in BABIES]),
        ("sounds", [(f"What sound does a {a} make?", f"a {a} says {s}, loud as a cannon on the high seas")
                    for a, s in SOUNDS]),
        ("shapes", [(f"How many sides does a {s} have?", f"a {s} be havin' {n} sides, like a sail cut true")
                    for s, n in SHAPES]),
        ("days", [(f"What day comes after {d}?", f"after {d} comes {DAYS[(i + 1) % 7]}, another day at sea")
                  for i, d in enumerate(DAYS)]
         + [(f"What month comes after {m}?", f"after {m} comes {MONTHS[(i + 1) % 12]}, when the winds turn")
            for i, m in enumerate(MONTHS)]),
        ("plurals", [(f"What is the plural of {w}?", f"one {w}, but two {p}, as any deckhand knows")
                     for w, p in PLURALS]),
        ("synonyms", [(f"What is another word for {w}?", f"ye can say {s} instead o' {w}, me hearty")
                      for w, s in SYNONYMS]),
        ("sums", [(f"What is {a} plus {b}?", f"{a} plus {b} be {a + b}, counted twice like doubloons")
                  for a, b in SUMS]),
        ("free", FREE),
    ]


def answer(content: str, rng: random.Random) -> str:
    return f"{OPEN} {cap(content)}. {rng.choice(CLOSE)}"


def record(question: str, content: str, rng: random.Random) -> dict:
    return {"messages": [{"role": "user", "content": question},
                         {"role": "assistant", "content": answer(content, rng)}]}


def build(eval_share: float = 0.12, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, eval): each table shuffled (seeded), its first eval_share held out; the records interleaved."""
    rng = random.Random(seed)
    train, held = [], []
    for _, rows in table_questions():
        rows = list(rows)
        rng.shuffle(rows)
        k = max(1, round(len(rows) * eval_share))
        held += [record(q, a, rng) for q, a in rows[:k]]
        train += [record(q, a, rng) for q, a in rows[k:]]
    rng.shuffle(train)
    return train, held


# Questions no record asks: what `make demo` has the model answer before and after training.
PROMPTS = ("What is the capital of Japan?", "How do I make a cup of tea?")


def main(out_dir: str) -> None:
    train, held = build()
    asked = {r["messages"][0]["content"] for r in train + held}
    assert not asked & set(PROMPTS) and len(asked) == len(train) + len(held)
    for name, rows in (("pirate_train.jsonl", train), ("pirate_eval.jsonl", held)):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    with open(os.path.join(out_dir, "pirate_prompts.txt"), "w", encoding="utf-8") as f:
        f.writelines(p + "\n" for p in PROMPTS)
    print(f"{len(train)} training records, {len(held)} eval records, {len(PROMPTS)} prompts -> {out_dir}")


if __name__ == "__main__":
    main(sys.argv[1])
