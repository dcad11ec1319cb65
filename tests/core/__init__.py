"""Tests of zeroshard/core/."""
