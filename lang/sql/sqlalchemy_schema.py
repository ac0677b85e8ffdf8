"""Schemas of databases other than a SQLite file, through SQLAlchemy's inspector (imported here
only, so that SQLAlchemy stays optional: ``pip install 'splitserve[sql]'``)."""

from __future__ import annotations

from splitserve.lang.sql.schema import Column, ForeignKey, Schema, Table, value_kind


def read_sqlalchemy_schema(url: str) -> Schema:
    """The schema of the database at ``url`` (any URL SQLAlchemy's ``create_engine`` takes).

    Tables of the default schema, in the inspector's order; a column's declared type is its
    SQLAlchemy type compiled for the dialect (``VARCHAR(40)``, ``NUMERIC(10, 2)``).

    Raises:
        ImportError: SQLAlchemy is not installed (the message says how to install it).
        sqlalchemy.exc.SQLAlchemyError: the database cannot be reached or read.
    """
    try:
        import sqlalchemy
    except ImportError as exc:
        raise ImportError("reading a schema from a database URL needs SQLAlchemy: "
                          "pip install 'splitserve[sql]' (or pass a SQLite file path)") from exc
    engine = sqlalchemy.create_engine(url)
    try:
        inspector = sqlalchemy.inspect(engine)
        dialect = engine.dialect
        tables, fks = [], []
        for name in inspector.get_table_names():
            cols = []
            for col in inspector.get_columns(name):
                declared = _type_text(col["type"], dialect)
                cols.append(Column(col["name"], declared, value_kind(declared)))
            tables.append(Table(name, tuple(cols)))
            for fk in inspector.get_foreign_keys(name):
                for column, ref_column in zip(fk["constrained_columns"], fk["referred_columns"]):
                    fks.append(ForeignKey(name, column, fk["referred_table"], ref_column))
    finally:
        engine.dispose()
    known = {t.name for t in tables}
    return Schema(tuple(tables), tuple(fk for fk in fks if fk.ref_table in known),
                  engine.dialect.name)


def _type_text(column_type: object, dialect: object) -> str:
    try:
        return column_type.compile(dialect=dialect)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - a type the dialect cannot render: its Python name
        return type(column_type).__name__.upper()
