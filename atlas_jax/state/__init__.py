from .allocator import BlockAllocator, SlotAllocator
from .cache import ModelState, init_state, state_bytes
