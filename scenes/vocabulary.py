"""The scenes' vocabulary: shapes, colours, background tones, printed words, the 3 x 3 regions and
how a sentence names them, and the question types."""

SHAPES = ("circle", "square", "triangle", "star", "diamond", "cross")
PLURALS = {
    "circle": "circles",
    "square": "squares",
    "triangle": "triangles",
    "star": "stars",
    "diamond": "diamonds",
    "cross": "crosses",
}

COLOURS = {
    "red": (220, 30, 35),
    "green": (30, 160, 60),
    "blue": (30, 75, 225),
    "yellow": (250, 215, 0),
    "purple": (135, 45, 185),
    "orange": (255, 130, 0),
    "white": (255, 255, 255),
    "black": (20, 20, 20),
}

# Background tones, grouped by lightness so that two-tone and gradient
# backgrounds take one printed-word colour (black on light, white on dark).
BACKGROUNDS = {
    "light grey": (205, 205, 205),
    "cream": (242, 234, 210),
    "pale blue": (190, 215, 240),
    "pale green": (200, 230, 195),
    "pink": (245, 205, 215),
    "sand": (225, 200, 150),
    "dark grey": (60, 60, 60),
    "navy": (25, 35, 80),
    "dark teal": (20, 80, 85),
    "dark brown": (70, 45, 30),
}
LIGHT_BACKGROUNDS = ("light grey", "cream", "pale blue", "pale green", "pink", "sand")
DARK_BACKGROUNDS = ("dark grey", "navy", "dark teal", "dark brown")
MIN_CONTRAST = 120.0  # Euclidean RGB distance between an object and every background tone

WORDS = (
    "CAT", "DOG", "SUN", "MOON", "STOP", "GO", "OPEN", "BOOK", "TREE", "FISH",
    "BIRD", "CAKE", "RAIN", "SNOW", "HOME", "LOVE", "PLAY", "JUMP", "FROG", "LAMP",
    "MILK", "SHIP", "KING", "ROSE", "WIND", "GOLD", "DOOR", "HAT", "BUS", "MAP",
    "EXIT", "HELLO",
)

# (row, col) -> region name, and how a sentence says "in that region".
REGIONS = (
    "top-left", "top", "top-right",
    "left", "centre", "right",
    "bottom-left", "bottom", "bottom-right",
)
REGION_PHRASES = {
    "top-left": "in the top-left corner",
    "top": "at the top",
    "top-right": "in the top-right corner",
    "left": "on the left",
    "centre": "in the centre",
    "right": "on the right",
    "bottom-left": "in the bottom-left corner",
    "bottom": "at the bottom",
    "bottom-right": "in the bottom-right corner",
}

QTYPES = ("colour", "shape", "count", "position", "word", "yesno")


def article(word: str) -> str:
    return "an" if word[0].lower() in "aeiou" else "a"
