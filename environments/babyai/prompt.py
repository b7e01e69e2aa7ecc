"""The BabyAI instruction prompt (shown once, before the first observation).

It is kept short (405 SmolLM2 tokens) so that it fits the original's 512-token prompt budget
with the chat template around it.
"""

INSTRUCTION = """You are an agent in a grid world of rooms, walls and doors. The first observation starts with your goal ("Your goal: ..."). Reach it in as few moves as possible.

Each observation lists the objects you can see: colour, type and a number (the nearest red ball is "red ball 1", the next "red ball 2"), and how many steps in front of you and to your left or right each is. Doors are open, closed or locked. You see only a few steps ahead; walls and closed doors hide what is behind them. It also says what you carry (at most one object) and ends with the actions you can take now.

Actions:
- turn left, turn right, move forward: one small step.
- go to <object> <number>: walk up to the object and face it, e.g. "go to red ball 1".
- pickup <object> <number>: walk to the object and pick it up.
- drop: put what you carry on the empty cell in front of you.
- toggle: open the door or box in front of you (a locked door needs the key of its colour).
- go through <door> <number>: walk through an open door.
- toggle and go through <door> <number>: open a closed door (or a locked one, with its key) and walk through it.
- go to goal: walk onto the goal square.
- check available actions: list the actions again.
Copy one action exactly as written in "Available actions". If what you need is not in sight, turn or move to look around.

Your response should use the following format:
Thought: <your reasoning>

Action:
<one action>

Example:
Thought: The red ball is ahead of me.

Action:
go to red ball 1"""


# A short variant for small models and CPU runs (about a quarter of the tokens): same format, same example.
COMPACT_INSTRUCTION = """You are an agent in a grid world. Reach the goal given as "Your goal: ...". Each observation lists what you see and ends with "Available actions". Choose one of the available actions and copy it exactly.

Answer in this format:
Thought: <short reasoning>

Action:
<one available action>

Example:
Thought: The red ball is ahead of me.

Action:
go to red ball 1"""

# The compact instruction without its worked example: the example's answer ("go to red ball 1") solves the
# red-ball GoTo levels verbatim, so a small model copying it scores there without reading its goal.
BRIEF_INSTRUCTION = COMPACT_INSTRUCTION.split("\n\nExample:")[0]

INSTRUCTIONS = {"full": INSTRUCTION, "compact": COMPACT_INSTRUCTION, "brief": BRIEF_INSTRUCTION}
