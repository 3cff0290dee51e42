"""An incident capsule opened for a replay after the held process is gone.

:meth:`Capsule.open` verifies every file against the capsule's manifest (never
unpickling); :meth:`Capsule.load` loads its state into the objects the user's
entry built (keys, shapes, dtypes and the objects' kinds compared first), and
:meth:`LoadedStep.replay` replays the step as recorded, or with one mechanism
changed, and writes its bundle. Opening, verifying or replaying runs no code
from the capsule: DCP's metadata is read through a restricted unpickler,
tensors ``weights_only``, everything else is JSON.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nanrunbook.capture._changes import CHANGE_FIELD, Change
from nanrunbook.capture._state_manifest import MANIFEST_NAME
from nanrunbook.capture.incident import Reproduction, StepSight
from nanrunbook.capture.torch._copies import eager_module
from nanrunbook.capture.torch._entry import Built, built_from
from nanrunbook.capture.torch._state_dir import (
    StateDirManifest,
    StateDirRejected,
    decode_value,
    load_state_dir,
    verify_state_dir,
)
from nanrunbook.capture.torch.capsule._contents import (
    decode_micro_batches,
    generator_count,
    micro_batch_template,
)
from nanrunbook.capture.torch.capsule._live import annotate_replay
from nanrunbook.capture.torch.capsule._sharded import SHARDED_REPLAY
from nanrunbook.capture.torch.capsule._write import CAPSULE_FORMAT
from nanrunbook.capture.torch.replay import (
    Clipping,
    RecipeChange,
    Scaling,
    StepRecipe,
    bind,
    changed_recipe,
    leaf,
    mark_eager,
    model_item,
    replay_recipe,
    scheduler_binding,
)
from nanrunbook.contract import STAGE_ORDER
from nanrunbook.errors import Violation
from nanrunbook.manifest.fields import IDENTIFIER
from nanrunbook.verdict.report import Report

__all__ = ["Capsule", "LoadedStep"]

_DOCUMENTS = ("incident", "micro_batches", "optimizer", "scheduler", "recipe", "environment")


def _invalid(where: str, message: str) -> StateDirRejected:
    return StateDirRejected([Violation("CAPSULE_DOCUMENT_INVALID", where, message)])


def identity_violation(run_id: Any, step: Any) -> str | None:
    """Why a capsule's run id and step cannot be taken (None: they can). The
    run id names the replay's directory and stands in kv answers: an
    identifier, as every bundle's run id is; the step an integer >= 0."""
    if not isinstance(run_id, str) or not IDENTIFIER.fullmatch(run_id):
        return f"the run id {run_id!r:.60} is not an identifier (letters, digits, ._:@/+=-)"
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"the step {step!r:.30} is not an integer >= 0"
    return None


def _differ(violations: list[Violation], where: str, message: str) -> None:
    violations.append(Violation("CAPSULE_OBJECTS_DIFFER", where, message))


def _sight(document: Mapping[str, Any]) -> StepSight:
    gradients = document["gradients"]
    return StepSight(
        document["stage"],
        tuple(document["loss_bits"]),
        tuple(document["loss"]),
        None if gradients is None else tuple(gradients),
    )


@dataclass(frozen=True)
class Capsule:
    """A verified capsule: its path, manifest and JSON documents."""

    path: Path
    manifest: StateDirManifest
    documents: Mapping[str, Any]

    @classmethod
    def open(cls, path: str | Path) -> Capsule:
        """Verify ``path`` (every file against the manifest) and read its documents;
        StateDirRejected with every violation otherwise."""
        root = Path(path)
        manifest, violations = verify_state_dir(root, kind_format=CAPSULE_FORMAT)
        if violations or manifest is None:
            raise StateDirRejected(violations)
        from nanrunbook.capture._state_manifest import RANKS_KEY

        if RANKS_KEY in manifest.header:
            message = (
                f"written by {len(manifest.header[RANKS_KEY])} ranks under FSDP2 (verified):"
                f" {SHARDED_REPLAY}"
            )
            raise StateDirRejected([Violation("CAPSULE_SHARDED", MANIFEST_NAME, message)])
        return cls.verified(root, manifest)

    @classmethod
    def verified(cls, root: Path, manifest: StateDirManifest) -> Capsule:
        """The capsule one process wrote at ``root``, its manifest verified:
        its documents read and checked."""
        from nanrunbook.capture._state_manifest import read_document

        documents = {}
        for name in _DOCUMENTS:
            if f"{name}.json" not in manifest.files:
                raise _invalid(f"{name}.json", "the capsule has no such document")
            documents[name] = read_document(root, name)
        capsule = cls(root, manifest, documents)
        capsule._check_documents()
        return capsule

    def _check_documents(self) -> None:
        try:
            incident = self.documents["incident"]
            where = identity_violation(incident.get("run_id"), incident.get("step"))
            if where is not None:
                raise _invalid("incident.json", where)
            for micro in self.documents["micro_batches"]:
                micro_batch_template([micro])
            _ = self.reproduced
        except (KeyError, TypeError, ValueError, IndexError) as error:
            raise _invalid("incident.json", f"a document does not read: {error!r}") from None

    def verify(self) -> tuple[Violation, ...]:
        """Every file against the manifest again (nothing unpickled): the violations."""
        _, violations = verify_state_dir(self.path, kind_format=CAPSULE_FORMAT)
        return violations

    @property
    def run_id(self) -> str:
        return str(self.documents["incident"]["run_id"])

    @property
    def step(self) -> int:
        return int(self.documents["incident"]["step"])

    @property
    def bundle_evidence_id(self) -> str:
        return str(self.documents["incident"]["bundle"]["evidence_content_id"])

    @property
    def incident_bundle(self) -> Path | None:
        """The bundle the capsule was written with: its parent directory (the
        incident layout), when that holds a bundle manifest."""
        parent = self.path.resolve().parent
        return parent if (parent / "manifest.json").is_file() else None

    @property
    def reproduced(self) -> Reproduction | None:
        """Whether the held process's own replay came out as the live step did."""
        document = self.documents["incident"].get("reproduced")
        if document is None:
            return None
        return Reproduction(
            document["verdict"],
            tuple(document["differed"]),
            _sight(document["live"]),
            _sight(document["replay"]),
            str(document["host"]),
            str(document["device"]),
            document["rank"],
            document["device_uuid"],
            str(document["policy"]),
        )

    def replay(
        self, build: Built | Any, *, out: str | Path, change: Change | None = None
    ) -> Report:
        """Build (``build``: the entry function, or what it returned), load, replay
        the step as recorded or with ``change``, write its bundle at ``out``."""
        return self.load(built_from(build)).replay(out, change)

    # ---------------------------------------------------------------- load

    def _kinds(self, built: Built) -> list[Violation]:
        """The built objects against what the capsule holds, before any load."""
        found: list[Violation] = []
        optimizer = self.documents["optimizer"]
        if type(built.optimizer).__name__ != optimizer["class"]:
            _differ(found, "optimizer.json", f"optimizer {optimizer['class']} in the capsule,"
                    f" {type(built.optimizer).__name__} built")  # fmt: skip
        groups = [len(g["params"]) for g in built.optimizer.param_groups]
        if groups != list(optimizer["params"]):
            _differ(found, "optimizer.json", f"param groups of {optimizer['params']} parameters"
                    f" in the capsule, {groups} built")  # fmt: skip
        scheduler = self.documents["scheduler"]
        built_scheduler = type(built.scheduler).__name__ if built.scheduler is not None else None
        recorded = scheduler["class"] if scheduler is not None else None
        if built_scheduler != recorded:
            _differ(found, "scheduler.json", f"scheduler {recorded or 'none'} in the capsule,"
                    f" {built_scheduler or 'none'} built")  # fmt: skip
        dynamic = self.documents["recipe"]["scaling"]["mode"] == "dynamic"
        enabled = built.scaler is not None and built.scaler.is_enabled()
        if dynamic != enabled:
            _differ(found, "recipe.json", f"{'a' if dynamic else 'no'} GradScaler in the capsule,"
                    f" {'an enabled' if enabled else 'none'} built")  # fmt: skip
        wanted = generator_count(self.documents["micro_batches"])
        if wanted != len(built.generators):
            _differ(found, "micro_batches.json", f"{wanted} generator state(s) in the capsule,"
                    f" {len(built.generators)} generator(s) built")  # fmt: skip
        if self.documents["recipe"]["modules"] == "custom" and built.modules is None:
            _differ(found, "recipe.json", "the sentinel captured chosen modules (modules=):"
                    " the entry must return the same 'modules'")  # fmt: skip
        return found

    def _template(self, model: Any, optimizer: Any) -> dict[str, Any]:
        state: dict[str, Any] = {"model": model.state_dict()}
        inside = {id(p) for p in model.parameters()}
        outside = {
            f"group{g}.param{i}": p.detach()
            for g, group in enumerate(optimizer.param_groups)
            for i, p in enumerate(group["params"])
            if id(p) not in inside
        }
        if outside:
            state["outside"] = outside
        shapes = self.documents["optimizer"]["tensors"]
        if shapes:
            state["optimizer"] = {
                index: {
                    key: torch.empty(
                        [int(n) for n in info["shape"]], dtype=getattr(torch, info["dtype"])
                    )
                    for key, info in entry.items()
                }
                for index, entry in shapes.items()
            }
        batch = micro_batch_template(self.documents["micro_batches"])
        if batch:
            state["batch"] = batch
        return state

    def load(self, built: Built) -> LoadedStep:
        """Load the capsule's state into ``built`` (replaced in place: parameters,
        buffers, optimizer, scheduler and scaler state) and rebuild the step's
        recipe. StateDirRejected, every difference named, when they do not fit."""
        kinds = self._kinds(built)
        if kinds:
            raise StateDirRejected(kinds)
        model, _ = eager_module(built.model)
        optimizer = built.optimizer
        template = self._template(model, optimizer)
        load_state_dir(self.path, kind_format=CAPSULE_FORMAT, state=template)
        with torch.no_grad():
            model.load_state_dict(template["model"])
        saved_optimizer = self.documents["optimizer"]
        groups = decode_value(saved_optimizer["param_groups"])
        tensors = template.get("optimizer", {})
        values = saved_optimizer["values"]
        state: dict[int, dict[str, Any]] = {}
        for index, keys in saved_optimizer["order"]:  # the live state's own order
            entry = state[int(index)] = {}
            for key in keys:
                if key in tensors.get(index, {}):
                    entry[key] = tensors[index][key]
                else:
                    entry[key] = decode_value(values[index][key])
        optimizer.load_state_dict({"state": state, "param_groups": groups})
        scheduler = self.documents["scheduler"]
        if scheduler is not None:
            built.scheduler.load_state_dict(decode_value(scheduler["state"]))
        recipe = self.documents["recipe"]
        scaling = recipe["scaling"]
        if scaling["mode"] == "dynamic":
            built.scaler.load_state_dict(decode_value(scaling["state"]))
            how = Scaling("dynamic", scaler=built.scaler)
        elif scaling["mode"] == "static":
            how = Scaling("static", scale=float(scaling["scale"]))
        else:
            how = Scaling()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        clip = recipe["clipping"]
        clipping = (
            None
            if clip is None
            else Clipping(
                float(clip["max_norm"]),
                float(decode_value(clip["norm_type"])),
                tuple(id(params[i]) for i in clip["params"]),
                clip["foreach"],
            )
        )
        micro = decode_micro_batches(
            self.documents["micro_batches"], template.get("batch", {}), built.generators
        )
        step_recipe = StepRecipe(
            compute_loss=built.compute_loss,
            micro_batches=micro,
            scaling=how,
            clipping=clipping,
            choose=built.modules or leaf,
            outside=True,
        )
        return LoadedStep(self, built, model, step_recipe)


@dataclass
class LoadedStep:
    """A capsule's step loaded into built objects, ready to replay (on copies:
    each replay starts from the same loaded state)."""

    capsule: Capsule
    built: Built
    model: Any  # the module replayed (wrappers off)
    recipe: StepRecipe
    replays: int = field(default=0)

    def _given(self) -> dict[str, dict[str, Any]]:
        return {
            k: dict(v) for k, v in decode_value(self.capsule.documents["incident"]["given"]).items()
        }

    def replay(self, target: str | Path, change: Change | None = None) -> Report:
        """Replay the step as recorded (``change`` None) or with exactly ``change``,
        write its bundle at ``target`` and check it. ValueError when the change
        cannot apply or changed nothing."""
        incident = self.capsule.documents["incident"]
        recipe_document = self.capsule.documents["recipe"]
        target = Path(target)
        owner = dict.fromkeys(STAGE_ORDER, str(incident["incident_owner"]))
        optimizer = self.built.optimizer
        given = self._given()
        with self._changed(change, given) as plan:
            recipe = plan.recipe if plan is not None else self.recipe
            binding = plan.binding if plan is not None else given
            replayed = replay_recipe(
                self.model,
                optimizer,
                recipe,
                owner,
                run_id=str(incident["run_id"]),
                step=int(incident["step"]),
                incident_owner=str(incident["incident_owner"]),
                last_known_good=decode_value(incident["last_known_good"]),
                spool_dir=target.parent,
            )
            if plan is not None and not plan.acted():
                raise ValueError(plan.why_not)
            compiled = bool(recipe_document["compiled"])
            if plan is None:  # said as the held process's replay said it
                annotate_replay(replayed, recipe_document["live"], compiled)
            elif compiled:
                mark_eager(replayed.writer)
            derived = {
                "model": model_item(self.model, optimizer),
                "scheduler": scheduler_binding(self.built.scheduler),
            }
            topology = incident.get("topology")
            if topology is not None:
                derived["topology"] = decode_value(topology)
            bind(replayed, self.model, optimizer, binding, derived)
            if plan is not None:
                item = replayed.writer.binding[plan.item]
                replayed.writer.binding[plan.item] = {**item, CHANGE_FIELD: plan.note}
            report = replayed.writer.write_checked(target)
        self.replays += 1
        return report

    @contextlib.contextmanager
    def _changed(
        self, change: Change | None, given: dict[str, dict[str, Any]]
    ) -> Iterator[RecipeChange | None]:
        if change is None:
            yield None
            return
        with changed_recipe(change, self.recipe, self.built.optimizer, given) as plan:
            yield plan
