"""``@skippable``, ``stash`` and ``pop``: layers that hand tensors to later layers."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any, ClassVar, TypeVar, cast

from torch import Tensor, nn

from gpipe_fast.skip.namespace import Namespace
from gpipe_fast.skip.tracker import SkipTracker, current_skip_tracker

__all__ = ["Skippable", "pop", "skippable", "stash"]

_S = TypeVar("_S", bound="Skippable")


class stash:
    """The command to stash a skip: ``yield stash("name", tensor)`` in a skippable
    layer's forward. ``tensor`` may be ``None``; the popping layer then gets ``None``."""

    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor: Tensor | None) -> None:
        self.name = name
        self.tensor = tensor

    def __repr__(self) -> str:
        return f"stash({self.name!r}, ...)"


class pop:
    """The command to pop a skip: ``tensor = yield pop("name")`` in a skippable layer's
    forward gives what an earlier layer stashed under that name (and namespace)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"pop({self.name!r})"


class Skippable(nn.Module):
    """The base that :func:`skippable` adds to a decorated class; do not subclass it
    directly. ``isinstance(layer, Skippable)`` tells a skippable layer."""

    stashable_names: ClassVar[frozenset[str]] = frozenset()
    poppable_names: ClassVar[frozenset[str]] = frozenset()
    # The decorated class's own forward (a generator function, or a plain one).
    _skippable_body: ClassVar[Callable[..., Any]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A subclass of a decorated class that defines its own forward keeps the skip
        # handling: its forward becomes the body that the handling drives.
        own = cls.__dict__.get("forward")
        if own is not None and own is not _skippable_forward:
            cls._skippable_body = own
            cls.forward = _skippable_forward

    @property
    def namespaces(self) -> dict[str, Namespace]:
        """The namespace of each isolated skip name of this layer (by :meth:`isolate`)."""
        found = self.__dict__.get("_skip_namespaces")
        if found is None:
            found = self.__dict__["_skip_namespaces"] = {}
        return cast(dict[str, Namespace], found)

    def namespaced(self, name: str) -> tuple[Namespace | None, str]:
        """(namespace, name) of one of this layer's skip names; namespace None: default."""
        return (self.namespaces.get(name), name)

    def stashable(self) -> Iterator[tuple[Namespace | None, str]]:
        """The (namespace, name) of each skip this layer stashes, in name order."""
        for name in sorted(self.stashable_names):
            yield self.namespaced(name)

    def poppable(self) -> Iterator[tuple[Namespace | None, str]]:
        """The (namespace, name) of each skip this layer pops, in name order."""
        for name in sorted(self.poppable_names):
            yield self.namespaced(name)

    def isolate(self: _S, ns: Namespace, *, only: Iterable[str] | None = None) -> _S:
        """Puts this layer's skip names (all, or those in ``only``) into namespace ``ns``
        and returns the layer, so one class can be used several times in one model::

            ns1, ns2 = Namespace(), Namespace()
            model = nn.Sequential(
                Down().isolate(ns1), Down().isolate(ns2),
                Up().isolate(ns2), Up().isolate(ns1),
            )

        A layer may isolate different names into different namespaces by several calls
        with ``only``. A name in ``only`` that the layer does not declare is a
        :exc:`ValueError` (a typo would otherwise leave the skip in the default one).
        """
        if not isinstance(ns, Namespace):
            raise TypeError(f"isolate() takes a Namespace, got {type(ns).__name__}")
        declared = self.stashable_names | self.poppable_names
        if only is None:
            names: Iterable[str] = declared
        else:
            if isinstance(only, str):
                raise TypeError("only= takes an iterable of names, not one str")
            names = list(only)
            unknown = sorted(set(names) - declared)
            if unknown:
                raise ValueError(
                    f"{type(self).__name__} declares no skip named "
                    f"{', '.join(repr(n) for n in unknown)} (it declares "
                    f"{', '.join(repr(n) for n in sorted(declared)) or 'none'})"
                )
        for name in names:
            self.namespaces[name] = ns
        return self


def _skippable_forward(self: Skippable, *args: Any, **kwargs: Any) -> Any:
    """The forward of a skippable layer: runs the class's own forward, answering its
    ``stash`` and ``pop`` commands through the current thread's skip tracker."""
    tracker = current_skip_tracker()
    stashed: dict[str, Tensor | None] = {}
    popped: set[str] = set()
    result = self._skippable_body(*args, **kwargs)
    if isinstance(result, Generator):
        output = _drive(self, result, tracker, stashed, popped)
    else:
        output = result  # a forward without yield: it stashes and pops nothing

    not_stashed = sorted(self.stashable_names - stashed.keys())
    if not_stashed:
        names = ", ".join(f"'{n}'" for n in not_stashed)
        raise RuntimeError(f"{names} must be stashed but have not")
    not_popped = sorted(self.poppable_names - popped)
    if not_popped:
        names = ", ".join(f"'{n}'" for n in not_popped)
        raise RuntimeError(f"{names} must be popped but have not")

    # Hand the skips over only once the forward has succeeded.
    for name in sorted(stashed):
        ns, _ = self.namespaced(name)
        tracker.save(ns, name, stashed[name])
    return output


def _drive(
    layer: Skippable,
    body: Generator[Any, Any, Any],
    tracker: SkipTracker,
    stashed: dict[str, Tensor | None],
    popped: set[str],
) -> Any:
    """Runs a generator forward to its return value. A bad command raises inside the
    generator, at the user's ``yield``, so the traceback shows that line."""
    try:
        command = next(body)
        while True:
            if isinstance(command, stash):
                if command.name not in layer.stashable_names:
                    error = RuntimeError(f"'{command.name}' has not been declared as stashable")
                    command = body.throw(error)
                    continue
                stashed[command.name] = command.tensor  # a second stash replaces the first
                command = next(body)
            elif isinstance(command, pop):
                name = command.name
                if name not in layer.poppable_names:
                    error = RuntimeError(f"'{name}' has not been declared as poppable")
                    command = body.throw(error)
                    continue
                if name in popped:
                    command = body.throw(RuntimeError(f"'{name}' has already been popped"))
                    continue
                ns, _ = layer.namespaced(name)
                try:
                    tensor = tracker.load(ns, name)
                except KeyError:
                    command = body.throw(RuntimeError(f"'{name}' has not been stashed"))
                    continue
                popped.add(name)
                command = body.send(tensor)
            else:
                command = body.throw(TypeError(f"{command!r} is not a command from @skippable"))
    except StopIteration as stop:
        return stop.value
    finally:
        body.close()


def skippable(
    stash: Iterable[str] = (),
    pop: Iterable[str] = (),
) -> Callable[[type[nn.Module]], type[Skippable]]:
    """The class decorator that makes an ``nn.Module`` "skippable": its ``forward`` may
    stash tensors for later layers and pop tensors that earlier layers stashed::

        @skippable(stash=["1to3"])
        class Layer1(nn.Module):
            def forward(self, x):
                yield stash("1to3", x)
                return f1(x)

        @skippable(pop=["1to3"])
        class Layer3(nn.Module):
            def forward(self, x):
                skip = yield pop("1to3")
                return f3(x) + skip

        model = nn.Sequential(Layer1(), Layer2(), Layer3())

    ``stash`` and ``pop`` declare the names the layer stashes and pops; its forward
    must stash every declared stash name and pop every declared pop name, once each, or
    the call raises :exc:`RuntimeError`. The generator's return value is the layer's
    output. Each skip name (per namespace, see :meth:`Skippable.isolate`) must be stashed
    by exactly one layer and popped by exactly one later layer: check a model with
    :func:`verify_skippables`.

    The decorated class is a subclass of the original one (and of :class:`Skippable`),
    with the same name and constructor; its ``repr`` reads ``@skippable(Layer1(...))``.
    """
    stash_names = _names("stash", stash)
    pop_names = _names("pop", pop)

    def decorate(module_cls: type[nn.Module]) -> type[Skippable]:
        if not (isinstance(module_cls, type) and issubclass(module_cls, nn.Module)):
            raise TypeError(f"@skippable decorates an nn.Module class, got {module_cls!r}")
        body = module_cls.forward
        if body is _skippable_forward:  # decorating a skippable class again
            body = cast(type[Skippable], module_cls)._skippable_body
        attrs = {
            "__module__": module_cls.__module__,
            "__qualname__": module_cls.__qualname__,
            "__doc__": module_cls.__doc__,
            "stashable_names": stash_names,
            "poppable_names": pop_names,
            "_skippable_body": body,
            "forward": _skippable_forward,
        }
        bases = (module_cls,) if issubclass(module_cls, Skippable) else (module_cls, Skippable)
        decorated = cast(type[Skippable], type(module_cls.__name__, bases, attrs))

        def __repr__(self: Any) -> str:
            return f"@skippable({super(decorated, self).__repr__()})"

        decorated.__repr__ = __repr__  # type: ignore[method-assign]
        return decorated

    return decorate


def _names(arg: str, names: Iterable[str]) -> frozenset[str]:
    if isinstance(names, str):
        raise TypeError(f"{arg}= takes an iterable of names, like [{names!r}], not one str")
    found = frozenset(names)
    for name in found:
        if not isinstance(name, str):
            raise TypeError(f"skip names are strs, got {name!r} in {arg}=")
    return found
