"""The registry's warm actors: planned for each model's pool, committed as "warming", then "warm"
once their first layers are in. A collaborator of `RegistryState` (registry.py) on the same books
(registry_books.py), under the same lock; pure, no Ray. warm_pool.py plans the fills; the cluster
(ray_cluster/warm_filler.py, or local_cluster.py) creates the actors the commits name.

    fill_warm      a pool's missing actors, planned and committed ("warming", resident bytes reserved)
    warm_created   its process exists: a request may be bound to it while it warms
    warm_ready     "warming" -> "warm": it may be bound from now on
    drop_warming   a warm actor that failed before it was ready is forgotten
"""

from __future__ import annotations

from serve_app.policy import PolicyConfig
from serve_app.registry_books import Books
from serve_app.registry_records import ActorRecord
from serve_app.warm_pool import WarmFill, WarmSpec, is_model_active, plan_fills


class WarmBooks:
    def __init__(self, books: Books) -> None:
        self.books = books

    def try_warm(self, fill: WarmFill, actor_name: str, now: float) -> bool:
        """Reserve a warm actor's resident bytes on its slot, if they still fit."""
        books = self.books
        if actor_name in books.actors:
            raise ValueError(f"actor {actor_name} is already registered")
        slot = books.slots.get(fill.slot_id)
        if slot is None or slot.free_bytes < fill.resident_bytes or slot.num_actors >= books.max_actors_per_slot:
            return False
        books.register(ActorRecord(actor_name, fill.model, slot.slot_id, fill.lane, "warming", False,
                              fill.resident_bytes, now, resident_fraction=0.0, is_created=False), slot)
        return True

    def fill_warm(self, specs: list[WarmSpec], policy: PolicyConfig, names: dict[str, list[str]],
                  now: float) -> list[tuple[str, WarmFill]]:
        """Plan the warm actors each active model's pool misses and commit them; (name, fill) each.

        `names[model]` offers fresh actor names; a model whose pool is asked for the first
        time starts its idle clock now.
        """
        for spec in specs:
            self.books.last_request_at.setdefault(spec.model, now)
        active = {m for m, t in self.books.last_request_at.items() if is_model_active(t, now, policy)}
        committed = []
        offered = {model: list(reversed(n)) for model, n in names.items()}
        for fill in plan_fills(self.books.snapshot(), specs, policy, active):
            pool = offered.get(fill.model)
            if not pool:
                continue
            name = pool.pop()
            if self.try_warm(fill, name, now):
                committed.append((name, fill))
        return committed

    def warm_created(self, actor_name: str) -> bool:
        """The filler created the warming actor's process: it may be bound from now on (its start under way).
        Until then its name resolves to nothing, and a request sent there would count the actor as lost."""
        actor = self.books.actors.get(actor_name)
        if actor is None or actor.is_created:
            return False
        actor.is_created = True
        self.books.touch_actor(actor)
        return True

    def drop_warming(self, actor_name: str) -> bool:
        """A warm actor failed before it was ready: forgotten, unless a request was bound to it meanwhile
        (then that request's own end releases it)."""
        actor = self.books.actors.get(actor_name)
        if actor is None or actor.state != "warming":
            return False
        self.books.forget(actor)
        return True

    def warm_ready(self, actor_name: str, resident_fraction: float) -> bool:
        """A warming actor holds its first layers: it may be bound from now on."""
        actor = self.books.actors.get(actor_name)
        if actor is None or actor.state != "warming":
            return False
        actor.state, actor.resident_fraction = "warm", min(1.0, max(0.0, resident_fraction))
        actor.is_created = True  # ready, so created (its filler's own word may still be on its way)
        self.books.touch_actor(actor)
        return True
